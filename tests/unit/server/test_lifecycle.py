"""The drain's timing rules, with an engine that records what it was told."""

from __future__ import annotations

import logging
import signal
import threading
import time
from types import SimpleNamespace
from typing import Any, cast

import pytest
import uvicorn

from orin.server.lifecycle import CUT_FLUSH_S, FLUSH_S, RPC_WAIT_EXIT, OrinServer
from orin.server.notify import SystemdNotifier
from orin.server.state import ServerState


class Engine:
    """``stop(drain=True)`` runs until the grace period ends or a ``stop(drain=False)``
    cancels everything, as the real engine's does."""

    def __init__(self) -> None:
        self.calls: list[tuple[bool, float]] = []
        self.draining = threading.Event()
        self.cancelled = threading.Event()
        self.rpc_wait: str | None = None  # the RPC worker a load waits for
        self.rpc_stalled: str | None = None  # the RPC worker a stop found stalled

    def stop(self, drain: bool = True, timeout: float = 30.0) -> None:
        self.calls.append((drain, timeout))
        if drain:
            self.draining.set()
            self.cancelled.wait(timeout=60)
        else:
            self.cancelled.set()

    def status(self) -> Any:
        return SimpleNamespace(heartbeat_ns=0, rpc_wait=self.rpc_wait, rpc_stalled=self.rpc_stalled)


def server(grace_s: float = 300.0) -> tuple[OrinServer, Engine, Any]:
    engine = Engine()
    state = SimpleNamespace(engine=engine, draining=False, model_name="m")
    config = uvicorn.Config(app=lambda *a: None, timeout_graceful_shutdown=5)
    srv = OrinServer(config, cast(ServerState, state), grace_s, SystemdNotifier({}))
    return srv, engine, state


def test_the_drain_gives_the_responses_the_rest_of_the_grace_period() -> None:
    """uvicorn's own wait for open connections (5 s by default) must not cut a slow
    reader's stream short while the grace period lasts."""
    srv, engine, state = server(300.0)
    engine.cancelled.set()  # the running requests finish at once
    srv.drain()
    assert state.draining and srv.should_exit and not srv.cut_short
    assert srv.exit_code is None  # serve exits 0
    assert engine.calls == [(True, 300.0)]
    timeout = srv.config.timeout_graceful_shutdown
    assert timeout is not None and 300.0 <= timeout <= 300.0 + FLUSH_S + 3


def test_a_second_signal_cancels_every_request_and_shortens_the_flush() -> None:
    srv, engine, _ = server(300.0)
    srv.handle_exit(signal.SIGINT, None)
    assert engine.draining.wait(timeout=60)  # the drain waits for the engine
    assert not srv.should_exit
    srv.handle_exit(signal.SIGINT, None)
    assert srv._drain_thread is not None
    srv._drain_thread.join(timeout=60)
    # the flush is the drain's or the cancelling thread's, whichever ends first: wait
    # for the one that took it to hand over to uvicorn
    deadline = time.monotonic() + 60
    while not srv.should_exit and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (False, 5.0) in engine.calls  # every request cancelled now
    assert srv.cut_short and srv.should_exit and not srv.force_exit
    timeout = srv.config.timeout_graceful_shutdown
    assert timeout is not None and timeout <= CUT_FLUSH_S + 3


def test_a_third_signal_stops_waiting_for_anything() -> None:
    srv, engine, _ = server(300.0)
    srv.handle_exit(signal.SIGTERM, None)
    assert engine.draining.wait(timeout=60)
    srv.handle_exit(signal.SIGTERM, None)
    srv.handle_exit(signal.SIGTERM, None)
    assert srv.force_exit and srv.should_exit
    engine.cancelled.set()  # let the drain thread end


def test_a_stop_while_the_load_waits_for_an_rpc_worker_exits_6_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The engine's stop gives up on a load that waits for a worker's answer (nothing
    interrupts that wait): the server says so and exits with the RPC workers' code,
    not 0 as after a drain."""
    srv, engine, _ = server(300.0)
    engine.rpc_wait = "10.0.0.2:50052"
    engine.cancelled.set()  # the engine's stop returns at once
    with caplog.at_level(logging.INFO, "orin.server"):
        srv.drain()
    assert srv.should_exit and srv.exit_code == RPC_WAIT_EXIT == 6
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "stopped while the model was loading: RPC worker 10.0.0.2:50052 accepted the "
        "connection but has not answered (a worker serves one server at a time: another "
        "server is probably using it); exiting with code 6 without waiting for it"
    ]
    assert "drained" not in caplog.text and "generation finished" not in caplog.text


def test_a_stop_that_gave_up_on_a_stalled_rpc_worker_exits_6_naming_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A worker that hangs after the handshake (mid-upload): the engine's stop gave up
    on it after rpc.STALL_S without a byte moving; the server names it and exits 6,
    not 0 as after a drain."""
    srv, engine, _ = server(300.0)
    engine.rpc_stalled = "10.0.0.3:50052"
    engine.cancelled.set()
    with caplog.at_level(logging.INFO, "orin.server"):
        srv.drain()
    assert srv.should_exit and srv.exit_code == RPC_WAIT_EXIT
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [
        "stopped while waiting for RPC worker 10.0.0.3:50052, which has taken no data and "
        "sent none for 10 s (the worker hangs, or the network drops its traffic); exiting "
        "with code 6 without waiting for it"
    ]
    assert "generation finished" not in caplog.text


def test_sighup_drains_as_sigterm_does(caplog: pytest.LogCaptureFixture) -> None:
    """By default SIGHUP (a closed terminal) ends the process at once, cutting every
    stream mid-answer; the server drains on it instead, then restores the handler."""
    srv, engine, state = server(300.0)
    engine.cancelled.set()  # the running requests finish at once
    before = signal.getsignal(signal.SIGHUP)
    with caplog.at_level(logging.INFO, logger="orin.server"), srv.capture_signals():
        assert signal.getsignal(signal.SIGHUP) == srv.handle_exit  # else it would end pytest
        signal.raise_signal(signal.SIGHUP)
        assert srv._drain_thread is not None
        srv._drain_thread.join(timeout=60)
    assert signal.getsignal(signal.SIGHUP) == before
    assert state.draining and srv.should_exit and not srv.cut_short
    assert engine.calls == [(True, 300.0)]
    assert "SIGHUP: the profile is not reloaded; stopping as for SIGTERM" in caplog.text


def test_an_ignored_sighup_stays_ignored() -> None:
    """Under ``nohup`` (or a supervisor that ignores the hangup) SIGHUP comes in
    ignored: a closed terminal must not stop the server then."""
    srv, _, state = server(300.0)
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with srv.capture_signals():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)
    assert srv._drain_thread is None and not state.draining
