"""One model across llama.cpp RPC workers, on loopback: two `orin-llm rpc-worker`
processes hold the layers of a generated model that `orin-llm serve --rpc` serves.

Greedy output across the workers is token-identical to a single-process run. A
worker lost mid-stream ends the server with exit code 6 and a line naming the
worker (llama.cpp's RPC client aborts on a lost connection, docs/fleet.md); a
restart while the worker is still down is exit 6 naming it again, before
anything loads; once the worker is back, a restart serves the same tokens as
before: that is the recovery a service manager's restart gives.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from orin.engine.rpc import RPC_LOST_EXIT, probe, rpc_available
from tests.serverutil import free_port, live_server, poll, wait_healthy

RPC_LOAD_S = 120.0  # a load across workers: every layer goes over loopback first

pytestmark = pytest.mark.llama

if not rpc_available():
    pytest.skip(
        "this llama.cpp build has no RPC backend (built with --no-rpc or before GGML_RPC "
        "was on): run scripts/install-llama-cpp.sh",
        allow_module_level=True,
    )

PROMPT = "The robot crossed the yard and"
BODY = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "return_token_ids": True}


def orin(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "orin", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ORIN_LLM_TELEMETRY": "off"},
    )


def stop(proc: subprocess.Popen[str]) -> str:
    """End a process if it still runs; its stderr."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.stderr.read() if proc.stderr else ""


@contextmanager
def worker(port: int, threads: int = 1) -> Iterator[subprocess.Popen[str]]:
    proc = orin("rpc-worker", "--port", str(port), "--threads", str(threads))
    try:
        deadline = time.time() + 60
        while probe(f"127.0.0.1:{port}", timeout=1) is not None:
            assert proc.poll() is None, stop(proc)
            assert time.time() < deadline, "the worker never listened"
            time.sleep(0.1)
        yield proc
    finally:
        stop(proc)


def serve(model: Path, port: int, workers: list[int]) -> subprocess.Popen[str]:
    rpc = ",".join(f"127.0.0.1:{p}" for p in workers)
    return orin(
        "serve", "--model", str(model), "--port", str(port), "--slots", "1", "--ctx", "512",
        "--telemetry", "off", "--rpc", rpc,
    )  # fmt: skip


def complete(base: str) -> list[int]:
    r = httpx.post(f"{base}/v1/completions", json=BODY, timeout=120)
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert len(ids) == 24
    return list(ids)


class CountingProxy:
    """A loopback TCP proxy in front of a worker that counts the bytes each way: what
    an RPC split costs the network."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.sent = self.received = 0  # server -> worker, worker -> server
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for s in (client, upstream):  # as llama.cpp's own sockets: no Nagle delay
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
                with self._lock:
                    if up:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def total(self) -> int:
        with self._lock:
            return self.sent + self.received

    def close(self) -> None:
        self._listener.close()


@pytest.fixture(scope="module")
def small_f16() -> Path:
    """Four layers: over two workers of equal memory llama.cpp puts three on the first
    and the last one (with the output) on the second, so both hold layers. f16, since
    the local CPU backend repacks some quantized types for its own kernels and the
    workers do not, which may change the last bits of a logit."""
    from orin.model import demo

    return demo.ensure("small", "f16")


@pytest.fixture(scope="module")
def local_tokens(small_f16: Path) -> list[int]:
    """The reference: the same model and request in a single process."""
    with live_server(small_f16, "engine: {slots: 1, n_ctx: 512}\n") as (base, _):
        return complete(base)


def test_the_rpc_backend_is_not_taken_for_a_local_gpu() -> None:
    from orin.llamacpp import build_info, llama

    # llama.cpp says "offload possible" for any build with the RPC backend ...
    assert llama().llama_supports_gpu_offload()
    # ... while orin-llm asks whether this machine has a GPU (CUDA is the GPU backend built)
    assert build_info().gpu_offload == build_info().cuda


def test_two_workers_serve_the_same_greedy_tokens_as_one_process(
    small_f16: Path, local_tokens: list[int]
) -> None:
    a, b, port = free_port(), free_port(), free_port()
    with worker(a), worker(b):
        proc = serve(small_f16, port, [a, b])
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, RPC_LOAD_S)
            assert complete(f"http://127.0.0.1:{port}") == local_tokens
        finally:
            err = stop(proc)
    # both workers were registered as devices and hold layers
    assert f"RPC worker 127.0.0.1:{a}: RPC" in err and f"RPC worker 127.0.0.1:{b}: RPC" in err
    assert f"3 on RPC0 (127.0.0.1:{a}), 1 on RPC1 (127.0.0.1:{b})" in err


def test_a_lost_worker_ends_the_server_with_exit_6_and_a_restart_recovers(
    small_f16: Path, local_tokens: list[int]
) -> None:
    a, b, port = free_port(), free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    with worker(a):
        with worker(b) as wb:
            proc = serve(small_f16, port, [a, b])
            try:
                wait_healthy(base, proc, RPC_LOAD_S)
                body = {**BODY, "max_tokens": 4096, "ignore_eos": True, "stream": True}
                chunks, errors = 0, []
                # the stream ends with the error naming the worker, then the server exits
                with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
                    try:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                event = json.loads(line[6:])
                                if "error" in event:
                                    errors.append(event["error"]["message"])
                                chunks += 1
                                if chunks == 3:
                                    wb.kill()  # the worker dies mid-stream
                    except httpx.HTTPError:  # the connection may close after the error
                        pass
                assert errors and f"lost RPC worker 127.0.0.1:{b} " in errors[0], errors
                assert proc.wait(timeout=120) == RPC_LOST_EXIT
            finally:
                err = stop(proc)
            assert f"lost RPC worker 127.0.0.1:{b} " in err, err
            assert f"exiting with code {RPC_LOST_EXIT}" in err
        # the restart a service manager makes while the worker is still down: refused
        # before anything loads, naming the worker
        down = serve(small_f16, port, [a, b])
        assert down.wait(timeout=120) == RPC_LOST_EXIT
        assert f"cannot reach RPC worker 127.0.0.1:{b} (" in stop(down)
        # the worker is back: the next restart serves the same tokens as before
        with worker(b):
            again = serve(small_f16, port, [a, b])
            try:
                wait_healthy(base, again, RPC_LOAD_S)
                assert complete(base) == local_tokens
            finally:
                stop(again)


class SilentWorker:
    """A worker that is busy with another server, as llama.cpp's looks to the next one:
    it accepts connections and never answers. ``asked`` is set once a connection sends
    something (llama.cpp's hello; serve's probes only connect and close)."""

    def __init__(self) -> None:
        self.asked = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", free_port()))
        self.port = int(self.listener.getsockname()[1])
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if conn.recv(64):
                self.asked.set()

    def close(self) -> None:
        self.listener.close()
        for conn in self.conns:
            conn.close()


def health(port: int, proc: subprocess.Popen[str]) -> httpx.Response | None:
    assert proc.poll() is None, stop(proc)
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    except httpx.HTTPError:
        return None


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_the_load_waits_for_a_busy_worker_exits_6_naming_it(
    tiny_f16: Path, sig: signal.Signals
) -> None:
    """llama.cpp waits for a busy worker's first answer without a limit, and nothing in
    the process can interrupt that wait: a service manager's stop (SIGTERM) or Ctrl-C
    (SIGINT) ends serve anyway, with the RPC workers' exit code and a line naming the
    worker, instead of a drain that waits for the load."""
    busy, port = SilentWorker(), free_port()
    try:
        proc = serve(tiny_f16, port, [busy.port])
        try:
            assert busy.asked.wait(RPC_LOAD_S), stop(proc)  # llama.cpp waits for the answer
            # the HTTP server answers (503, loading): its signal handlers are in place
            loading = poll(lambda: health(port, proc), "the server answering while it loads")
            assert loading.status_code == 503
            proc.send_signal(sig)
            code = proc.wait(timeout=RPC_LOAD_S)
        finally:
            err = stop(proc)
    finally:
        busy.close()
    assert code == RPC_LOST_EXIT, err
    assert (
        f"stopped while the model was loading: RPC worker 127.0.0.1:{busy.port} accepted "
        "the connection but has not answered"
    ) in err
    assert "drained; exiting" not in err and "Traceback" not in err


class StallingProxy:
    """A worker that hangs in the middle of the weights' upload, as one whose board
    froze or whose GPU stopped answering: a relay to a real worker that passes the
    handshake (a few dozen bytes each way) and the first ``after`` bytes of the
    upload, then neither forwards nor reads anything more. ``stalled`` is set then."""

    def __init__(self, target: int, after: int) -> None:
        self.target, self.after = target, after
        self.sent = 0  # server -> worker, on the connection llama.cpp keeps
        self.stalled = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", free_port()))
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b, up in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pump, args=(a, b, up), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(1 << 16):
                if up:
                    self.sent += len(data)
                    if self.sent > self.after:
                        self.stalled.set()
                        return  # src stays open and unread: the server's sends block
                dst.sendall(data)
            for s in (src, dst):  # a connection serve's probe opened and closed
                s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_while_a_worker_stalls_the_weights_upload_exits_6_naming_it(
    tiny_f16: Path, sig: signal.Signals
) -> None:
    """A worker that passed the handshake and then hangs mid-upload leaves llama.cpp
    sending (or waiting for an answer) without a limit: a stop does not wait for it
    through the grace period and then exit 0 as if it had drained, but gives up once
    nothing has moved to or from the worker for rpc.STALL_S, and exits 6 naming it."""
    from orin.engine.rpc import STALL_S

    after = 64 << 10  # well past the handshake, well before the end of the weights
    assert tiny_f16.stat().st_size > 4 * after
    port, real = free_port(), free_port()
    with worker(real):
        hung = StallingProxy(real, after)
        try:
            proc = serve(tiny_f16, port, [hung.port])
            try:
                assert hung.stalled.wait(RPC_LOAD_S), stop(proc)
                loading = poll(lambda: health(port, proc), "the server answering while it loads")
                assert loading.status_code == 503
                proc.send_signal(sig)
                code = proc.wait(timeout=RPC_LOAD_S)  # the grace period is 30 s
            finally:
                err = stop(proc)
        finally:
            hung.close()
    assert code == RPC_LOST_EXIT, err
    assert (
        f"stopped while waiting for RPC worker 127.0.0.1:{hung.port}, which has taken no "
        f"data and sent none for {STALL_S:.0f} s"
    ) in err
    assert "drained; exiting" not in err and "Traceback" not in err


class HttpOnThePort(SilentWorker):
    """Another program on the worker's address (a web server): it answers llama.cpp's
    hello with an HTTP error and closes the connection."""

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            if conn.recv(64):
                self.asked.set()
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
            conn.close()


def test_a_program_that_is_no_worker_is_named_as_a_failed_handshake(tiny_f16: Path) -> None:
    """A wrong address (or a worker of another RPC protocol version) fails llama.cpp's
    handshake: exit 6 with a line that says so and what to check, not a lost worker
    that a restart would bring back."""
    other, port = HttpOnThePort(), free_port()
    try:
        proc = serve(tiny_f16, port, [other.port])
        try:
            code = proc.wait(timeout=RPC_LOAD_S)
        finally:
            err = stop(proc)
    finally:
        other.close()
    assert other.asked.is_set()
    assert code == RPC_LOST_EXIT, err
    assert f"RPC worker 127.0.0.1:{other.port} failed llama.cpp's RPC handshake" in err
    assert "lost RPC worker" not in err and "Traceback" not in err


def traffic(
    model: Path,
    n_workers: int,
    tokens: tuple[int, int] = (16, 48),
    threads: int = 1,
    proxy: bool = True,
) -> dict[str, float]:
    """Bytes per generated token between the server and its workers (the difference of
    two greedy requests of different lengths after a warm-up request of the same
    prompt, so that both reuse the cached prompt and only the generated tokens differ)
    and the decode rate; ``n_workers`` 0 is the single-process run."""
    ports = [free_port() for _ in range(n_workers)]
    with contextlib.ExitStack() as stack:
        for p in ports:
            stack.enter_context(worker(p, threads))
        proxies = [CountingProxy(p) for p in ports] if proxy else []
        for x in proxies:
            stack.callback(x.close)
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = serve(model, port, [x.port for x in proxies] if proxy else ports)
        stack.callback(stop, proc)
        wait_healthy(base, proc, RPC_LOAD_S)
        counts, rates = [], []
        warm = httpx.post(f"{base}/v1/completions", json={**BODY, "max_tokens": 1}, timeout=300)
        assert warm.status_code == 200, warm.text
        for n in tokens:
            before = sum(x.total() for x in proxies)
            body = {**BODY, "max_tokens": n, "ignore_eos": True}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            counts.append(sum(x.total() for x in proxies) - before)
            rates.append(r.json()["timings"]["predicted_per_second"])
    return {
        "bytes_per_token": (counts[1] - counts[0]) / (tokens[1] - tokens[0]),
        "tokens_per_s": rates[1],
    }


def test_the_traffic_per_token_carries_the_activations_not_the_weights(small_f16: Path) -> None:
    from orin.model.gguf import read_model_info

    info = read_model_info(small_f16)
    t = traffic(small_f16, 2)
    # each decode step sends at least the hidden state to a worker (n_embd f32 values)
    # and brings the logits back; the weights (sent once, at load) do not come again
    assert t["bytes_per_token"] > 4 * info.n_embd
    assert t["bytes_per_token"] < small_f16.stat().st_size


def _measure(argv: list[str]) -> None:
    """The figures in docs/fleet.md: python -m tests.integration.test_rpc [SIZE [QUANT]]."""
    from orin.model import demo

    size, quant = (argv + ["medium", "f16"][len(argv) :])[:2]
    model = demo.ensure(size, quant)
    print(f"model: demo {size} {quant} ({model.stat().st_size / 2**20:.0f} MiB), loopback")
    for n in (0, 1, 2):
        t = traffic(model, n, threads=0)  # workers: one thread per core, as the server
        direct = traffic(model, n, threads=0, proxy=False)  # the rate without the proxy's hop
        print(
            f"{n} RPC workers: {direct['tokens_per_s']:.1f} tokens/s "
            f"({t['tokens_per_s']:.1f} through the counting proxy), "
            f"{t['bytes_per_token'] / 1024:.1f} KiB per generated token"
        )


if __name__ == "__main__":
    _measure(sys.argv[1:])
